"""The optimizer layer of strata.torch: kinds (AdamW, Adam, SGD, Lion, Adagrad, the names
strata.torch exports) over base (StrataOptimizer, what they share), which owns resident (torch's
optimizer over the resident parameters' fp32 masters, and their pager) and state (the state as
torch's optimizers hold it: state_dict, load_state_dict, checkpoints); checks holds what
their creation refuses. Private, as every module of strata.torch: the package's surface is
strata.torch itself."""
