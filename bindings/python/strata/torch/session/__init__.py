"""The session layer of strata.torch: one offloaded model's runtime, registered tensors,
executor, optimizer and step state (session.StrataSession), with the parts it owns, one job
each: runtime (what offload chose and the runtime made from it), builder (the blocks laid out
in Strata), passes (the step's passes and the grads they deliver), placer (where the training
state lives). Private, as every module of strata.torch: the package's surface is
strata.torch itself."""
