"""Opening graphs on a device: ORT sessions, the prepacked weight store, QNN contexts, the memory check."""
