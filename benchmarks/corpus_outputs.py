"""Compare two identity-corpus recordings (benchmarks/identity_corpus.py) on what a user receives, for a path
that may legitimately interleave the rows' events differently, such as the CPU's compiled step (it runs no
lockstep tokens, so rows exit at their own steps):

    RDLM_COMPILE=0 OMP_NUM_THREADS=1 python benchmarks/identity_corpus.py record eager.jsonl \\
        --only generate/tiny/ --only batch/
    RDLM_COMPILE=force OMP_NUM_THREADS=1 python benchmarks/identity_corpus.py record compiled.jsonl \\
        --only generate/tiny/ --only batch/
    python benchmarks/corpus_outputs.py eager.jsonl compiled.jsonl

Per case it compares each request's tokens, iterations per token, finish reasons and texts (`generate`
cases: `tokens`, `steps`, `finish_reasons`, `texts`; `batch` cases: each request's events in its own order,
and the failures and refusals), not the interleaving of the rows' events, the engine's step count or its
timeline. Log-probabilities are compared per row (or request) and reported as the largest difference, for the
float32 models and the bfloat16 one apart. Exit status 1 when a float32 case differs. This is a script, not a
test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(path: str) -> dict[str, dict]:
    return {record["name"]: record for record in map(json.loads, Path(path).read_text().splitlines())}


def floats(value, out: list[float]) -> list[float]:
    """The log-probabilities in `value` (stored as float.hex strings), in order."""
    if isinstance(value, list):
        for item in value:
            floats(item, out)
    elif isinstance(value, dict):
        for item in value.values():
            floats(item, out)
    elif isinstance(value, str) and value.lstrip("-").startswith("0x"):
        out.append(float.fromhex(value))
    return out


def outputs(result: dict) -> tuple[object, object]:
    """(what a user receives, where its log-probabilities are, row by row)."""
    if "tokens" in result:
        return (result["tokens"], result["steps"], result["finish_reasons"], result["texts"]), result["logprobs"]
    if isinstance(result.get("events"), list):
        per_request = [[event[:3] for event in request] for request in result["events"]]
        return (per_request, result.get("failures"), result.get("refused")), result["events"]
    return result, None


def main() -> int:
    a, b = load(sys.argv[1]), load(sys.argv[2])
    differ: list[str] = []
    worst = {"float32": 0.0, "bfloat16": 0.0}
    for name, record in a.items():
        (got_a, lp_a), (got_b, lp_b) = outputs(record["result"]), outputs(b[name]["result"])
        if got_a != got_b:
            differ.append(name)
        xs, ys = floats(lp_a, []), floats(lp_b, [])
        if xs and len(xs) == len(ys):
            kind = "bfloat16" if "bf16" in name else "float32"
            worst[kind] = max(worst[kind], max(abs(x - y) for x, y in zip(xs, ys, strict=True)))
    print(f"{len(a)} cases: {len(a) - len(differ)} give every request the same tokens, iterations and finish "
          f"reasons; {len(differ)} differ")
    for name in differ:
        print("  differs:", name)
    print(f"largest log-probability difference: float32 {worst['float32']:.3g}, bfloat16 {worst['bfloat16']:.3g}")
    return int(any("bf16" not in name for name in differ))


if __name__ == "__main__":
    sys.exit(main())
