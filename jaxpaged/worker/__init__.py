"""The device side: the model runner (parameters and KV pool on the mesh, compiled step
programs), the step packer (one int32 transfer per step), the host-tier copies, and a minimal
paged generation loop used as a reference beside the engine. The sampler those programs run is
`jaxpaged.model.sampler`."""
