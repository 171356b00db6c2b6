cd /work/main
for R in 1 2 3; do
  uptime >> /tmp/exp/pm_minilm.log
  HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_peak_memory.py --models minilm_lora_sdpa --configs plain,bits2 --steps 7 --repeats 1 --out /tmp/exp/pmm_new_$R.json >> /tmp/exp/pm_minilm.log 2>&1
  PYTHONPATH=/tmp/exp/head/src HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_peak_memory.py --models minilm_lora_sdpa --configs bits2 --steps 7 --repeats 1 --out /tmp/exp/pmm_head_$R.json >> /tmp/exp/pm_minilm.log 2>&1
done
uptime >> /tmp/exp/pm_minilm.log
echo done >> /tmp/exp/pm_minilm.log
