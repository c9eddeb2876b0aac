"""The data layer: synthetic sources with exact loss floors (a noisy linear teacher, a
sparse Markov source), real data (digits, text), held-out draws, and the data-parallel
loader every topology reads through. ARCHITECTURE.md maps its modules.

    ds, model_cfg = make_dataset(data_cfg, "transformer", model_cfg)
    loader = ShardedLoader(ds, batch_size, rank, world, seed, micro_batches)
    for step in range(steps):
        micro_batches = loader.next()        # [(x, y)] * k, host NumPy
"""

from dtlab.models.data.dataset import ArrayDataset, Dataset, TokenWindows
from dtlab.models.data.factory import DataConfig, make_dataset, make_heldout
from dtlab.models.data.loader import ShardedLoader
from dtlab.models.data.markov import MarkovSource
from dtlab.models.data.teacher import TeacherDataset, teacher_floor

__all__ = ["ArrayDataset", "DataConfig", "Dataset", "MarkovSource", "ShardedLoader",
           "TeacherDataset", "TokenWindows", "make_dataset", "make_heldout", "teacher_floor"]
