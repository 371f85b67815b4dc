#!/usr/bin/env bash
# Runs a command-line program that must refuse its input: expect_error.sh RC REGEX -- CMD ARGS...
# Passes when CMD exits with status RC within 30 s (a hang fails) and its stderr matches the
# extended regular expression REGEX. In CMD's arguments @DIR@ becomes a fresh directory, @FIFO@
# a fresh FIFO (named pipe) and @BIG@ a sparse file big.txt of 65 MiB + 1 byte (over the 64 MiB
# --prompt-file cap), all in a temporary folder removed afterwards; @EMPTY@ is removed (CMake
# drops empty arguments, so an empty value is spelled @EMPTY@); @XFF@ becomes the byte 0xFF
# (never valid in UTF-8; CMake files cannot hold it).
set -u
want_rc=$1 regex=$2
shift 3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/dir.bin" && mkfifo "$tmp/fifo.bin" && truncate -s $((65 * 1024 * 1024 + 1)) "$tmp/big.txt"
args=()
for a in "$@"; do
  a=${a//@EMPTY@/}
  a=${a//@XFF@/$'\xff'}
  a=${a//@DIR@/$tmp/dir.bin}
  a=${a//@BIG@/$tmp/big.txt}
  args+=("${a//@FIFO@/$tmp/fifo.bin}")
done
set -- "${args[@]}"
err=$(timeout 30 "$@" 2>&1 >/dev/null)
rc=$?
if [ "$rc" -ne "$want_rc" ]; then
  printf 'FAIL: exit status %s (want %s): %s\nstderr: %s\n' "$rc" "$want_rc" "$*" "$err"
  exit 1
fi
if ! grep -Eq -- "$regex" <<<"$err"; then
  printf 'FAIL: stderr does not match /%s/: %s\nstderr: %s\n' "$regex" "$*" "$err"
  exit 1
fi
printf 'ok: %s -> %s\n' "$*" "$err"
