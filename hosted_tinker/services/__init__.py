"""The service layer: what the routes ask of the server, in the server's own terms.

Routes (`api/`) parse and answer HTTP; these modules check access, validate against the model and
the server's limits, record futures and hand work to the scheduler or the sampler. Nothing in here
knows about HTTP beyond raising `HTTPException` with the message a user should read.
"""
