# How minilm_lora_sdpa_mask_and_trims_rounds.log and minilm_lora_sdpa_chunked_forward_rounds.log were made: three
# rounds, fresh processes, each variant's src (a copy, on PYTHONPATH) in turn, plain beside the first; variants:
#   mask_and_trims:   (1) the dropout mask saved and the math path's transients told to the heap trimmer,
#                     (2) the mask saved only, (3) 473f1a6 (the mask drawn again in backward)
#   chunked_forward:  (1) this revision (the forward a chunk at a time too), (2) variant (1) above, (3) 473f1a6
#   bash variants.sh LOG SRC_1 SRC_2 SRC_3
LOG=$1; shift
cd "$(git rev-parse --show-toplevel)"
for R in 1 2 3; do
  FIRST=1
  for V in "$@"; do
    uptime >> "$LOG"; echo "variant $V" >> "$LOG"
    CF=bits2; [ $FIRST = 1 ] && CF=plain,bits2; FIRST=0
    PYTHONPATH=$V HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_peak_memory.py --models minilm_lora_sdpa \
      --configs $CF --steps 7 --repeats 1 --out "/tmp/minilm_lora_sdpa_$R.json" >> "$LOG" 2>&1
  done
done
uptime >> "$LOG"
echo done >> "$LOG"
# bert_long_sdpa_rounds.log: the same protocol with --models bert_long_sdpa --steps 6, two variants: this revision
# (chunks of a sample's heads where a sample holds more than a chunk) and 5bada3e (chunks of whole samples).
