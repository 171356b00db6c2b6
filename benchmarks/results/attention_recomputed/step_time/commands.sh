# How the *_rounds.log files were made: three rounds, this revision (plain and 2 bits) alternating with the
# revision before (fadb5a7's src, unpacked at $BEFORE, 2 bits), fresh processes each.
#   bash commands.sh llama_lora llama_lora_rounds.log
#   bash commands.sh minilm_lora_sdpa minilm_lora_sdpa_rounds.log
MODEL=$1 LOG=$2 BEFORE=${BEFORE:-/tmp/exp/head/src}
cd "$(git rev-parse --show-toplevel)"
for R in 1 2 3; do
  uptime >> "$LOG"
  HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_peak_memory.py --models "$MODEL" --configs plain,bits2 --steps 7 --repeats 1 --out "/tmp/${MODEL}_$R.json" >> "$LOG" 2>&1
  PYTHONPATH=$BEFORE HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_peak_memory.py --models "$MODEL" --configs bits2 --steps 7 --repeats 1 --out "/tmp/${MODEL}_before_$R.json" >> "$LOG" 2>&1
done
uptime >> "$LOG"
echo done >> "$LOG"
