"""The data flags and the one function that turns them into a Dataset.

    --data auto      teacher for a classifier (mlp), markov for a language model (transformer)
    --data teacher   synthetic classification, floor known       (teacher.py)
    --data markov    synthetic language, floor known             (markov.py)
    --data digits    real 8x8 digits, d_in 64, 10 classes         (real.py)
    --data text      bytes of --path, vocab 256                   (real.py)

The data is fixed by --data-seed alone, so runs with different run seeds,
world sizes or topologies train on the same examples.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dtlab.models.config import ConfigError, choice, described, non_negative, positive
from dtlab.models.data.dataset import Dataset, TokenWindows
from dtlab.models.data.markov import MAX_TABLE, MarkovSource
from dtlab.models.data.real import load_digits, load_text
from dtlab.models.data.teacher import TeacherDataset

CLASSIFICATION, LANGUAGE = "classification", "language"
SOURCES = {"teacher": CLASSIFICATION, "digits": CLASSIFICATION,
           "markov": LANGUAGE, "text": LANGUAGE}
AUTO = {CLASSIFICATION: "teacher", LANGUAGE: "markov"}
IMPLIED = {"digits": {"d_in": 64, "n_classes": 10}, "text": {"vocab": 256}}


@dataclass
class DataConfig:
    data: str = choice("auto", "auto", "teacher", "markov", "digits", "text",
                       help="data source; auto: teacher for mlp, markov for transformer")
    path: str = described("", "file whose bytes are the tokens of --data text")
    n_samples: int = described(65536, "examples of --data teacher")
    label_noise: float = described(0.1, "teacher label noise: P(label is another class)")
    markov_order: int = described(2, "tokens of context of the --data markov source")
    markov_support: int = described(4, "next tokens each Markov context can emit")
    n_tokens: int = described(1 << 20, "length of the --data markov stream")
    data_seed: int = described(1234, "fixes the data, independent of --seed")

    def validate(self):
        positive(self, "n_samples", "markov_order", "markov_support")
        non_negative(self, "data_seed")
        if not 0 <= self.label_noise < 1:
            raise ConfigError(f"--label-noise must be in [0, 1) (got {self.label_noise})")
        if self.n_tokens < 2:
            raise ConfigError(f"--n-tokens must be at least 2 (got {self.n_tokens})")
        if self.data == "text" and not self.path:
            raise ConfigError("--data text needs --path FILE")
        if self.path and self.data != "text":
            raise ConfigError(f"--path is read only with --data text (got --data {self.data})")


def task_of(model_name: str, model_cfg) -> str:
    """LANGUAGE if the model config has vocab and seq_len, CLASSIFICATION if d_in and n_classes."""
    if hasattr(model_cfg, "vocab") and hasattr(model_cfg, "seq_len"):
        return LANGUAGE
    if hasattr(model_cfg, "d_in") and hasattr(model_cfg, "n_classes"):
        return CLASSIFICATION
    raise ConfigError(f"--model {model_name}: no data source fits its config")


def source_of(cfg: DataConfig, model_name: str, model_cfg) -> str:
    """The source --data names for this model (auto resolved), or a ConfigError if it misfits."""
    task = task_of(model_name, model_cfg)
    source = AUTO[task] if cfg.data == "auto" else cfg.data
    if SOURCES[source] != task:
        fits = " or ".join(s for s, t in SOURCES.items() if t == task)
        raise ConfigError(f"--data {source} is {SOURCES[source]} data; --model {model_name} "
                          f"needs {task} data (--data {fits})")
    return source


def implied_model(cfg: DataConfig, model_name: str, model_cfg):
    """The model config the data fixes, without building the data (for the servers):
    digits sets d_in=64, n_classes=10; text sets vocab=256; the others change nothing."""
    source = source_of(cfg, model_name, model_cfg)
    return dataclasses.replace(model_cfg, **IMPLIED.get(source, {}))


def make_dataset(cfg: DataConfig, model_name: str, model_cfg) -> tuple[Dataset, object]:
    """Build the dataset `cfg` names and the model config the data fixes.

    Returns (dataset, dataclasses.replace(model_cfg, ...)): digits sets d_in=64,
    n_classes=10; text sets vocab=256; teacher and markov take d_in/n_classes and
    vocab/seq_len from the model config and change nothing. A source that does not
    fit the model, or a --path that cannot be used, is a ConfigError naming the flag.
    """
    source = source_of(cfg, model_name, model_cfg)
    if source == "teacher":
        if model_cfg.n_classes < 2:
            raise ConfigError(f"--n-classes must be at least 2 for --data teacher "
                              f"(got {model_cfg.n_classes})")
        ds = TeacherDataset(cfg.n_samples, model_cfg.d_in, model_cfg.n_classes,
                            cfg.label_noise, cfg.data_seed)
        return ds, dataclasses.replace(model_cfg)
    model_cfg = implied_model(cfg, model_name, model_cfg)
    if source == "digits":
        return load_digits(), model_cfg
    if source == "text":
        return load_text(cfg.path, model_cfg.seq_len), model_cfg
    return markov_dataset(cfg, model_cfg.vocab, model_cfg.seq_len), model_cfg


def make_heldout(cfg: DataConfig, model_name: str, model_cfg, n: int) -> Dataset:
    """`n` held-out examples: fresh draws from the training data's own distribution (the
    same teacher, the same Markov chain), never seen in training, the same for every run
    of one data config. Real data (digits, text) has no split yet: a ConfigError."""
    source = source_of(cfg, model_name, model_cfg)
    if source == "teacher":
        return TeacherDataset(n, model_cfg.d_in, model_cfg.n_classes, cfg.label_noise,
                              cfg.data_seed, draw=1)
    if source == "markov":
        held = dataclasses.replace(cfg, n_tokens=n * model_cfg.seq_len + 1)
        return markov_dataset(held, model_cfg.vocab, model_cfg.seq_len, draw=1)
    raise ConfigError(f"--eval-every needs --data teacher or markov: held-out examples of "
                      f"--data {source} are not split off")


def markov_dataset(cfg: DataConfig, vocab: int, seq_len: int, draw: int = 0) -> TokenWindows:
    """A stream of --n-tokens from the Markov source, in windows of seq_len."""
    if cfg.markov_support > vocab:
        raise ConfigError(f"--markov-support {cfg.markov_support} exceeds --vocab {vocab}")
    if vocab ** (cfg.markov_order + 1) > MAX_TABLE:
        raise ConfigError(f"--markov-order {cfg.markov_order} with --vocab {vocab} needs a "
                          f"table of {vocab ** (cfg.markov_order + 1)} > {MAX_TABLE} entries")
    if cfg.n_tokens < seq_len + 1:
        raise ConfigError(f"--n-tokens {cfg.n_tokens} is too short for one window of "
                          f"--seq-len {seq_len} (needs {seq_len + 1})")
    src = MarkovSource(vocab, cfg.markov_order, cfg.markov_support, cfg.data_seed)
    return TokenWindows("markov", src.sample(cfg.n_tokens, draw), seq_len, vocab,
                        src.floor(seq_len), src.describe())
