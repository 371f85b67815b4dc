#!/usr/bin/env bash
# Runs two command lines that must generate the same text: expect_same_text.sh CMD_A... ::: CMD_B...
# Passes when both exit with status 0 within 30 s each and print the same stdout up to the line
# "=== summary ===" (reference_transformer's report, which has timings, follows it).
set -u
a=() b=() side=a
for x in "$@"; do
  if [ "$x" = ":::" ]; then side=b; elif [ $side = a ]; then a+=("$x"); else b+=("$x"); fi
done
text() { timeout 30 "$@" 2>/dev/null | sed '/^=== summary ===$/,$d'; return "${PIPESTATUS[0]}"; }
out_a=$(text "${a[@]}"); rc_a=$?
out_b=$(text "${b[@]}"); rc_b=$?
if [ "$rc_a" -ne 0 ] || [ "$rc_b" -ne 0 ]; then
  printf 'FAIL: exit status %s / %s (want 0)\n  %s\n  %s\n' "$rc_a" "$rc_b" "${a[*]}" "${b[*]}"
  exit 1
fi
if [ -z "$out_a" ] || [ "$out_a" != "$out_b" ]; then
  printf 'FAIL: different (or no) text\n  %s:\n%s\n  %s:\n%s\n' "${a[*]}" "$out_a" "${b[*]}" "$out_b"
  exit 1
fi
printf 'ok: same text: %s\n' "$out_a"
