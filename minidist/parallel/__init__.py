"""Parallel strategies, one file per idea, each built on minidist.comm and the core, not on its siblings.

    data_parallel.py   chapter 3: replicas and the averaged gradient (naive, then bucketed)
    balance.py         chapter 3: stragglers, the batch split by speed
    pipeline.py        chapters 4-5: the engine that runs a schedule (pipeline_stage.py: the model cut
                       into stages; schedules.py: the schedules as data)
    tensor_layers.py   chapter 6: column/row-parallel layers and Megatron's f and g
    tensor_parallel.py chapter 6: the tensor-parallel GPT (sequence.py: sequence parallelism)
    zero.py            chapter 8: ZeRO stage by stage (fsdp.py: stage 3's gathering)
    zero_partition.py  chapter 8: flat units cut into chunks, AdamW on a chunk
    mesh.py            chapter 9: the device mesh, pp x dp x tp, and each rank's groups
    composed.py        chapter 9: DP x TP x PP (x CP) on the mesh (tensor_stage.py: a pipeline stage of
                       tensor-parallel layers; context_stage.py: a stage on a piece of every sequence;
                       zero_tensor.py: ZeRO over dp of each tp shard)
    context_parallel.py chapter 11: each sequence split over cp ranks, attention in a ring (ulysses.py:
                       by all-to-all)
    expert_parallel.py chapter 11: experts split over ep ranks, tokens by all-to-all
    checkpointing.py   chapters 2, 8: saving any of them, resuming on any layout (one format, resharded)
"""
