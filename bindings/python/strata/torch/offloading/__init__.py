"""offload()'s stages (strata.torch._offload runs them in order): rollback (the undo log),
request (the arguments checked and resolved), residents (the model outside the streamed
blocks on the device; the resident blocks' forwards), install (the host budget's account, the
streamed blocks' forwards and hooks, model.strata and the model's hooks). Named apart from
strata.torch.offload, the function the package exports. Private, as every module of
strata.torch: the package's surface is strata.torch itself."""
