cd /work/main
for R in 1 2 3; do
  uptime >> /tmp/exp/pm_rounds.log
  HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_peak_memory.py --models llama_lora --configs plain,bits2 --steps 7 --repeats 1 --out /tmp/exp/pm_new_$R.json >> /tmp/exp/pm_rounds.log 2>&1
  PYTHONPATH=/tmp/exp/head/src HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_peak_memory.py --models llama_lora --configs bits2 --steps 7 --repeats 1 --out /tmp/exp/pm_head_$R.json >> /tmp/exp/pm_rounds.log 2>&1
done
uptime >> /tmp/exp/pm_rounds.log
echo done >> /tmp/exp/pm_rounds.log
