"""The data layer: synthetic sources with exact loss floors, real data, and the
data-parallel loader.

    ds, model_cfg = make_dataset(data_cfg, "transformer", model_cfg)
    loader = ShardedLoader(ds, batch_size, rank, world, seed, micro_batches)
    for step in range(steps):
        micro_batches = loader.next()        # [(x, y)] * k, host NumPy

    factory.py   DataConfig (the --data flags), make_dataset, make_heldout
    dataset.py   the Dataset protocol; ArrayDataset, TokenWindows
    teacher.py   noisy linear teacher, floor -(1-e) ln(1-e) - e ln(e/(C-1))
    markov.py    sparse order-k Markov source, floor from its exact entropy rate
    real.py      digits (scikit-learn) and byte-level text
    loader.py    ShardedLoader: one global order, rank slices, resumable
"""

from dtlab.models.data.dataset import ArrayDataset, Dataset, TokenWindows
from dtlab.models.data.factory import DataConfig, make_dataset, make_heldout
from dtlab.models.data.loader import ShardedLoader
from dtlab.models.data.markov import MarkovSource
from dtlab.models.data.teacher import TeacherDataset, teacher_floor

__all__ = ["ArrayDataset", "DataConfig", "Dataset", "MarkovSource", "ShardedLoader",
           "TeacherDataset", "TokenWindows", "make_dataset", "make_heldout", "teacher_floor"]
