"""The ground floor: the vocabulary every layer shares (formats, backends, client types, record fields,
atomic writes, run-directory selectors).  Torch-free and free of imports from any other kvbench package."""
