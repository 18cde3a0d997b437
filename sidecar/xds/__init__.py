"""Rules over xDS: the sidecar as a client of a control plane (`CONFIG_TYPE=GRPC_XDS_SOTW`)."""
