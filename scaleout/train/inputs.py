"""Path-valued config keys whose files a start reads: opened and sniffed before anything is written
or spawned (``scaleout train``'s launcher preflight, then every rank before ``init``), so a corrupt
or foreign file is one line naming the key and the file instead of a traceback from deep inside a
rank after the output directory exists.

Which files and how to sniff them is the model family's knowledge (``Family.check_input_files``;
BERT's: ``model.init_checkpoint`` and the ``data.path`` shards, scaleout/families/bert/inputs.py).

``checkpoint.dir`` is not sniffed: a corrupt checkpoint there is reported by
:mod:`scaleout.checkpoint` and the newest one that verifies is used (a write torn by preemption
must not stop a requeue).
"""

from __future__ import annotations

from scaleout.config.schema import Config
from scaleout.train.outputs import check_outputs


def check_input_files(cfg: Config) -> None:
    """Sniff the files ``cfg``'s family reads (one line naming the key on a bad one), and the
    folders the run writes (scaleout/train/outputs.py)."""
    check_outputs(cfg)
    cfg.model.family.check_input_files(cfg)
