"""Parallel strategies, one file per idea, each built on minidist.comm and the core, not on its siblings.

    data_parallel.py   chapter 3: replicas and the averaged gradient (naive, then bucketed)
    balance.py         chapter 3: stragglers, the batch split by speed
    pipeline.py        chapters 4-5: the model cut into stages (schedules.py: the schedules as data)
    tensor_layers.py   chapter 6: column/row-parallel layers and Megatron's f and g
    tensor_parallel.py chapter 6: the tensor-parallel GPT (sequence.py: sequence parallelism)
    zero.py            chapter 8: ZeRO stage by stage (fsdp.py: stage 3's gathering)
    mesh.py            chapter 9: the device mesh, pp x dp x tp, and each rank's groups
    checkpointing.py   saving and resuming any of them (zero_checkpoint.py: ZeRO's shards)
"""
