"""The kernel families' host launches: ``portable`` (Triton language), ``hopper`` (Gluon, sm_90)
and the split reducer both share (``reduce``). Each prepares a launch once per call signature
(configs, constexprs, compiled handles) and then launches it with the call's tensors."""
