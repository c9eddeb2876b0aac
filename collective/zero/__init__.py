"""ZeRO stages 1-3 (Rajbhandari et al. 2020; FSDP, Zhao et al. 2023): the sharded state,
the unit layout, gathered parameters, the collective stream, the trainer's parts and the
sharded checkpoints."""
