"""The core every layer may use: streams and attention sites, conventions, the model guard, messages,
optional extras, cancellation, files written whole, class names, resumable runs."""

#: relevancy's version (re-exported as `relevancy.__version__`; here so that a run's identity can name it from below)
__version__ = "0.1.0"
