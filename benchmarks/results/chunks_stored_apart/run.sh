# How the logs were made: SRC_NEW is this revision's src, SRC_OLD the revision before's (copies, on PYTHONPATH).
#   bash run.sh SRC_NEW SRC_OLD
# minilm_lora_sdpa.log: three rounds of fresh processes alternating the two, plain beside the first
# (derivative_restore/variants.sh); live_peaks.log: the live heap per op, one process each.
D=benchmarks/results/chunks_stored_apart
cd "$(git rev-parse --show-toplevel)"
bash benchmarks/results/derivative_restore/variants.sh $D/minilm_lora_sdpa.log minilm_lora_sdpa 7 bits2,bits2+ckpt "$1" "$2"
for V in "$1" "$2"; do
  echo "src $V" >> $D/live_peaks.log
  PYTHONPATH=$V HF_HUB_OFFLINE=1 .venv/bin/python $D/live_peaks.py minilm_lora_sdpa 2>/dev/null >> $D/live_peaks.log
done
