"""What differs between the torch releases dcp_plus supports, kept out of the other layers."""
