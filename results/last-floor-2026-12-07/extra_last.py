"""results/unbuilt-layers-2026-12-07/job_ab.py's extra variants (exec'd into it; AB_EXTRA=this file): "uniform", the
rule before this page (every request's floor ``cost.FLOOR`` while none waits, ``cost.request_floors`` replaced), and
"none" (``"sources": []``)."""
# ruff: noqa: F821  (VARIANTS and set_rows are job_ab.py's)
import vllm_dsbd.engine.cost as C
_floors = C.request_floors
def set_uniform(on):
    def s():
        C.request_floors = (lambda rem: [C.FLOOR] * len(rem)) if on else _floors; set_rows(1024)
    return s
VARIANTS["dsbd"] = ({"method": "dsbd"}, set_uniform(False))
VARIANTS["uniform"] = ({"method": "dsbd"}, set_uniform(True))
VARIANTS["none"] = ({"method": "dsbd", "sources": []}, set_uniform(False))
