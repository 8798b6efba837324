# Sourced by scripts that leave results under $OUT for the device tool, which brings back at most 8 files of at most
# 16 MiB each (/work/.library/device/README.md "Limits").
#   split_for_device FILE [MAX_BYTES]   a FILE over MAX_BYTES (default 15 MiB) becomes FILE.part00, FILE.part01, ...
#                                       (join them here with `cat FILE.part* > FILE`); a smaller one stays whole
split_for_device() {
  local f=$1 max=${2:-15728640}
  rm -f "$f".part*
  if [ "$(stat -c %s "$f")" -gt "$max" ]; then split -b "$max" -d "$f" "$f.part" && rm -f "$f"; fi
}
