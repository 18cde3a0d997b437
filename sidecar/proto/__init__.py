"""Python stubs generated from proto/ by grpcio-tools (`make proto`); never edited by hand."""
