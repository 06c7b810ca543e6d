# Sourced by run.sh, spark.sh and beam.sh. measure LABEL ROWS COMMAND...: one whole process under /usr/bin/time -v;
# prints wall seconds, rows/s and the largest resident set among the processes the timer waits on.
measure() {
  local label="$1" rows="$2"; shift 2
  local log; log=$(mktemp)
  /usr/bin/time -v "$@" >/dev/null 2>"$log" || { tail -20 "$log" >&2; rm -f "$log"; exit 1; }
  local wall rss
  wall=$(awk -F': ' '/Elapsed \(wall clock\)/ {n=split($2,a,":"); s=0; for(i=1;i<=n;i++) s=s*60+a[i]; print s}' "$log")
  rss=$(awk -F': ' '/Maximum resident set size/ {printf "%.2f", $2/1048576}' "$log")
  printf '%-38s %12s rows %8.2f s %12.0f rows/s %6s GiB peak\n' "$label" "$rows" "$wall" "$(echo "$rows / $wall" | bc -l)" "$rss"
  rm -f "$log"
}

# demo_data ROWS: the directory holding ROWS generated demo persons (generated once, then reused).
demo_data() {
  local data="out/rows-$1"
  [ -f "$data/persons.parquet" ] || dprelease demo-data --rows "$1" --out "$data" >/dev/null
  printf '%s\n' "$data"
}
