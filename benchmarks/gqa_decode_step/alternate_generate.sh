# alternate_generate.sh ROUNDS "threads:batch ..." > out.txt: whole greedy generate per token, onnxruntime-genai / the baseline checkout (BEFORE=) / this checkout (VASWANI=), in turn
rounds=$1; configs=$2
for r in $(seq $rounds); do for q in int4 int8; do for cfg in $configs; do t=${cfg%:*}; b=${cfg#*:}
  echo "$q $r genai t$t b$b $(timeout 200 /work/venvs/bench-engines/ortgenai/bin/python $(dirname $0)/generate_per_token.py genai /tmp/gqa/engines/ortgenai-$q $t $b 2>&1 | tail -1)"
  echo "$q $r before t$t b$b $(PYTHONPATH=${BEFORE:?a checkout of the baseline commit} timeout 200 /work/main/.venv/bin/python $(dirname $0)/generate_per_token.py vaswani /tmp/gqa/engines/vaswani-onnx-$q $t $b 2>&1 | tail -1)"
  echo "$q $r after t$t b$b $(PYTHONPATH=${VASWANI:-$PWD} timeout 200 /work/main/.venv/bin/python $(dirname $0)/generate_per_token.py vaswani /tmp/gqa/engines/vaswani-onnx-$q $t $b 2>&1 | tail -1)"
done; done; done
