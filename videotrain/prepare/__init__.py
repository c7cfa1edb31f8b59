"""``python -m videotrain.prepare``: turn a dataset as downloaded into what ``data=...`` reads.

- ``kinetics``: the official release CSVs + downloaded videos -> ``train.csv`` / ``val.csv``
  (``path label``), ``classes.txt`` and the list of missing videos (``kinetics.py``);
  optionally re-encoded to a 256 or 320 px short side with a keyframe every second, in
  parallel and resumably (``reencode.py``).

Something-Something v2 needs no conversion: ``data=ssv2`` reads its JSON files as released
(``videotrain/data/ssv2.py``), and missing videos are reported by the loader's preflight.
"""

from videotrain.prepare.kinetics import prepare_kinetics, read_release_csv
from videotrain.prepare.reencode import EncodeSettings, encode_all

__all__ = ["EncodeSettings", "encode_all", "prepare_kinetics", "read_release_csv"]
