"""DeepSpeed's ``deepspeed.ops.op_builder`` path: dsrun builds no C++/CUDA
extensions (:mod:`.builder`)."""
