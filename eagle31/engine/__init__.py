"""Disaggregated features (`features.mode=engine`): inference workers on Ray feed the torchrun trainers.

The target runs in N inference workers (Ray actors, `eagle31.engine.worker`), not in the trainer's
process, and its features reach the trainers through Ray's object store: no feature touches disk.
One `FeaturePool` actor (`eagle31.engine.pool`), on the node of rank 0, plans the micro-batches the
trainers' loaders will ask for, in the order they ask, hands each target forward's worth of samples
to a worker, and keeps what the workers computed until the trainer rank that needs it takes it.

    features (each rank)    eagle31.engine.features: EngineFeatures sources for the FeatureLoader
        |   take(rank, ids) / compute(ids)                       ^  ObjectRefs -> tensors
        v                                                        |
    FeaturePool (one actor) plan -> requests -> workers -> parts of micro-batches, <= pool_tokens ahead
        |   compute(token rows)
        v
    InferenceWorker x N     eagle31.engine.worker: the HF target (a vLLM engine can take its place)

What is better here than in TorchSpec's design, which this follows:

* a worker that dies, or hangs past its timeout, is started again and the samples it was computing are
  asked again; the run goes on (`engine/worker_restarts`, `engine/requeued` in metrics.jsonl); only a
  worker that fails on its own (an exception), that Ray cannot place, or that dies more often than
  `features.engine.max_restarts` stops the run, in one line; nothing waits without end (docs/engine.md);
* the order is the loader's: features are put together by sample position before batching, so what a
  trainer gets does not depend on which worker computed what or when, and the checkpoint's loader
  position (and its record of the consumed sample ids) makes `resume=auto` train on exactly the samples
  an uninterrupted run would. Each request is one target forward of the micro-batch's length-sorted
  group (`eagle31.data.capture.target_forward`), the very forward `features.mode=online` runs, so the
  HF workers' features, losses and final weights are bit-identical to online training;
* metrics: the workers' capacity, what they produced, what the trainers consumed and could consume,
  and how long the trainers waited (`eagle31.engine.features.FeatureEngine.metrics`,
  `eagle31.trainer`), and the dry run says how many workers keep the planned trainers busy
  (`eagle31.engine.capacity`).

`eagle31.engine.cluster` joins or starts the Ray cluster. docs/engine.md has the commands.
"""
