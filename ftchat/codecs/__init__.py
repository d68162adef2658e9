"""Weight and cache codecs: NVFP4, the expert row layouts, FP8 rows. Leaves: they import only
torch and ftchat.errors, so the model, the kernels and the offload code can all use them."""
