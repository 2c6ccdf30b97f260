"""dcp_plus.stagers"""
