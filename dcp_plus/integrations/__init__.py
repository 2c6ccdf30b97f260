"""dcp_plus.integrations"""
