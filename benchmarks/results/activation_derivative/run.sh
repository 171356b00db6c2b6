# How the logs were made: SRC_NEW is this revision's src, SRC_OLD the revision before's, SRC_NO_NOTE this
# revision without the heap trimmer told the derivative's bytes before it is made (copies, on PYTHONPATH).
#   bash run.sh SRC_NEW SRC_OLD SRC_NO_NOTE
# Three rounds of fresh processes alternating two sources, plain beside the first
# (derivative_restore/variants.sh); live_peaks.log: the live heap per op (chunks_stored_apart/live_peaks.py).
D=benchmarks/results/activation_derivative
V=benchmarks/results/derivative_restore/variants.sh
cd "$(git rev-parse --show-toplevel)"
bash $V $D/minilm_lora_sdpa.log minilm_lora_sdpa 7 bits2,bits2+ckpt "$1" "$2"
bash $V $D/minilm_lora_sdpa_without_trim_note.log minilm_lora_sdpa 7 bits2,bits2+ckpt "$3" "$2"
for V in "$3" "$2"; do
  echo "src $V" >> $D/live_peaks.log
  PYTHONPATH=$V HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/results/chunks_stored_apart/live_peaks.py 2>/dev/null >> $D/live_peaks.log
done
