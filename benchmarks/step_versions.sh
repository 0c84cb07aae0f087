#!/usr/bin/env bash
# `bench step` of two versions of the package on one machine, alternating, each run in its own
# process: what a refactor costs or saves, side by side. Usage, from the repository root:
#   OLD=/path/holding/an/older/crossdistill OUT=results/ [ROUNDS=2] \
#       bash benchmarks/step_versions.sh <bench step arguments>
# Writes $OUT/step-{old,new}-<round>.json as each run finishes, then prints the ratios.
set -uo pipefail
OLD=${OLD:?set OLD to a folder holding an older crossdistill package}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
for round in $(seq 1 "${ROUNDS:-2}"); do
    for version in old new; do
        path=$PWD
        [[ $version == old ]] && path=$OLD
        # run from the version's own folder: `python -m` puts the working folder first on the path
        (cd "$path" && python3 -m crossdistill bench step --json "$@") \
            | tail -1 > "$OUT/step-$version-$round.json"
    done
done
python3 - "$OUT" <<'PY'
import glob, json, sys
runs = {}
for path in sorted(glob.glob(f"{sys.argv[1]}/step-*-*.json")):
    try:
        r = json.load(open(path))
    except ValueError:
        continue
    runs.setdefault(path.split("step-")[-1].split("-")[0], []).append(r["tokens_per_s"])
print(json.dumps({v: {"tokens_per_s": t, "mean": sum(t) / len(t)} for v, t in runs.items()}))
if "old" in runs and "new" in runs:
    print("new / old tokens/s:", sum(runs["new"]) / len(runs["new"]) / (sum(runs["old"]) / len(runs["old"])))
PY
