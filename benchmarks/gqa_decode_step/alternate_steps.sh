# alternate_steps.sh ROUNDS STEPS "label=folder ..." "threads:batch ..." > out.txt: each system in its own process per round, in turn (a label starting with genai runs onnxruntime-genai from /work/venvs/bench-engines/ortgenai); summarise with medians.py / paired_ratios.py
rounds=$1; steps=$2; systems=$3; configs=$4
for r in $(seq $rounds); do for cfg in $configs; do t=${cfg%:*}; b=${cfg#*:}; for s in $systems; do
  label=${s%%=*}; folder=${s#*=}
  case $label in genai*) py="/work/venvs/bench-engines/ortgenai/bin/python $(dirname $0)/step_genai.py";; *) py="/work/main/.venv/bin/python $(dirname $0)/step_vaswani.py";; esac
  echo "$r $label t$t b$b $(PYTHONPATH=${VASWANI:-$PWD} timeout 200 $py $folder $t $b $steps 2>&1 | tail -1)"
done; done; done
