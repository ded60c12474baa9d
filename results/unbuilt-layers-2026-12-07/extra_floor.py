"""job_ab.py's extra variants (exec'd into it): the floor at 1.0, with and without prompt rows, and `"sources": []`."""
import vllm_dsbd.engine.cost as C
def set_floor(f, rows=1024):
    def s():
        C.FLOOR = f; set_rows(rows)
    return s
VARIANTS["floor1"] = ({"method": "dsbd"}, set_floor(1.0))
VARIANTS["floor1norows"] = ({"method": "dsbd"}, set_floor(1.0, 0))
VARIANTS["dsbd"] = ({"method": "dsbd"}, set_floor(0.95))
VARIANTS["none"] = ({"method": "dsbd", "sources": []}, set_floor(0.95))
