"""The pieces of the step-time model `taco_triton.plan` (its public entry): the hardware
(`hardware`), the model and its parallel layout (`spec`), the communications of a step as the
library's own code issues them (`trace`), and their timing and composition into a step
(`compose`)."""
