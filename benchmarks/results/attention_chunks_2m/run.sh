# How the two logs were made: copies of src differing only in recomputed_attention.CHUNK_BYTES (on PYTHONPATH),
# three rounds of fresh processes alternating, plain beside the first (derivative_restore/variants.sh).
#   bash run.sh SRC_2MIB SRC_4MIB SRC_1MIB
D=benchmarks/results/attention_chunks_2m
V=benchmarks/results/derivative_restore/variants.sh
cd "$(git rev-parse --show-toplevel)"
bash $V $D/chunks_2m_against_4m.log minilm_lora_sdpa 7 bits2,bits2+ckpt "$1" "$2"
bash $V $D/chunks_1m_against_2m.log minilm_lora_sdpa 7 bits2,bits2+ckpt "$3" "$1"
