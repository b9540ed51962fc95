"""What a user runs: the `tide` command (`cli`), the demo (`demo`, on the model trained on `demo_corpus`),
`tide bench` (`bench`), the support matrix over every model type (`support_matrix`), and the TIDE router
import (`convert`)."""
