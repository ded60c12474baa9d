"""A corpus generation worker: ``python -m vllm_dsbd.distill._worker JOB_JSON RANK`` (started by
``corpus.build_corpus`` when ``--gen-workers`` > 1). Kept out of the package's imports so that runpy runs it once."""

import json
import pathlib
import sys

from .corpus import _gen_worker

if __name__ == "__main__":
    job = json.loads(pathlib.Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    _gen_worker(rank, job, job["todo"][rank:: job["workers"]], job["threads"])
