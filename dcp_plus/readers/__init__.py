"""dcp_plus.readers"""
