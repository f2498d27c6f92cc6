"""Workers: one rank of the model each (model runner, sampler); executors drive them."""
