# How rounds_*.log were made: three rounds, fresh processes, each variant's src (a copy, on PYTHONPATH) in turn;
# the first variant runs plain too. Variants: (1) this revision (derivatives restored in place, the inverse table
# by bisection, grids fitted on a sample of a view), (2) the revision before.
#   bash variants.sh LOG MODEL STEPS CONFIGS SRC_1 SRC_2
LOG=$1; MODEL=$2; STEPS=$3; CONFIGS=$4; shift 4
cd "$(git rev-parse --show-toplevel)"
for R in 1 2 3; do
  FIRST=1
  for V in "$@"; do
    uptime >> "$LOG"; echo "variant $V" >> "$LOG"
    CF=$CONFIGS; [ $FIRST = 1 ] && CF=plain,$CONFIGS; FIRST=0
    PYTHONPATH=$V HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_peak_memory.py --models "$MODEL" \
      --configs "$CF" --steps "$STEPS" --repeats 1 --out "/tmp/${MODEL}_$R.json" >> "$LOG" 2>&1
  done
done
uptime >> "$LOG"
echo done >> "$LOG"
