"""dcp_plus.writers"""
