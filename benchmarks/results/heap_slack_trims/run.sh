# The three models of heap_slack_trims/*.log: this revision's src against f13822e's (copies on PYTHONPATH), three
# rounds each, fresh processes alternating, plain beside this revision (derivative_restore/variants.sh).
#   bash run.sh NEW_SRC OLD_SRC
D=benchmarks/results/heap_slack_trims
V=benchmarks/results/derivative_restore/variants.sh
cd "$(git rev-parse --show-toplevel)"
bash $V $D/minilm_lora_sdpa.log minilm_lora_sdpa 7 bits2,bits2+ckpt "$1" "$2"
bash $V $D/resnet18.log resnet18 7 bits2 "$1" "$2"
bash $V $D/bert_long_sdpa.log bert_long_sdpa 6 bits2 "$1" "$2"
