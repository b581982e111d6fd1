"""What every stage shares: the typed config and its command line, errors, model references, prompt
sources, the sampler, dtype choice, progress expectations, tracking and provenance.

common/ imports no stage (decode/, distill/); both import it.
"""
