"""configs/default.py on subword tokens: a 4096-entry byte-level BPE.

The same model, optimisation, sequence length (128 tokens, now ~3.4 bytes
each) and batch as the default; only the data's tokenizer differs
(``data.tokenizer='bpe'``, trained once on the train split and cached under
the TFDS data dir, ``moejax/data/bpe.py``), and with it ``vocab_size`` and
the embedding and output tables (4096 x 128 each). Compare it with the
default by ``loss_per_byte`` in the eval rows (nats per UTF-8 byte), not by
``loss`` (nats per token of different sizes). docs/training.md has the
measured losses.

    python -m experiments.train --config=configs/default_bpe.py --workdir=/tmp/moejax_bpe
"""

import importlib.util
import os

BPE_VOCAB_SIZE = 4096


def _default():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py")
  spec = importlib.util.spec_from_file_location("moejax_configs_default", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config():
  default = _default()
  cfg = default.get_config()
  from moejax.train.config import experiment_config_dict
  return experiment_config_dict(
      model=dict(default.model(), vocab_size=BPE_VOCAB_SIZE),
      data=dict(cfg.data.to_dict(), tokenizer="bpe", bpe_vocab_size=BPE_VOCAB_SIZE),
      train=cfg.train.to_dict())
