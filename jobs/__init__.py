"""The jobs shipped with raytpu (installed as ``raytpu.jobs``): MSHNet, CDEIT and a Transformers causal LM."""
