"""dcp_plus.manager"""
