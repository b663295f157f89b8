"""The core every layer may use: streams and attention sites, conventions, the model guard, messages,
optional extras, cancellation, files written whole, class names."""
