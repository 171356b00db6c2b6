# How minilm.log and resnet18.log were made (gpt2.log: one round, bits2 only, 5 steps): variants are copies of src
# on PYTHONPATH, new = DEFAULT_TRIM_BYTES 64 MiB (the revision before), t32 / t16 = the same with 32 / 16 MiB.
#   bash rounds.sh LOG MODEL STEPS   (the copies under /tmp/exp/{new,t32,t16}/src)
LOG=$1; MODEL=$2; STEPS=$3
cd /work/main
for R in 1 2; do
  for V in new t32 t16; do
    uptime >> "$LOG"; echo "variant $V" >> "$LOG"
    CF=bits2; [ $V = new ] && CF=plain,bits2
    PYTHONPATH=/tmp/exp/$V/src HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_peak_memory.py --models "$MODEL" \
      --configs "$CF" --steps "$STEPS" --repeats 1 --out "/tmp/exp/trim_${MODEL}_$R.json" >> "$LOG" 2>&1
  done
done
echo done >> "$LOG"
