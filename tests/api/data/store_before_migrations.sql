-- A store written by hpservice before schema migrations (stop 23, api/store.py at c23c5c7):
-- the tests upgrade it and check that every job, metric and event is kept.
BEGIN TRANSACTION;
CREATE TABLE events (
	job_id VARCHAR(80) NOT NULL, 
	seq INTEGER NOT NULL, 
	kind VARCHAR(16) NOT NULL, 
	data_json TEXT NOT NULL, 
	PRIMARY KEY (job_id, seq)
);
INSERT INTO "events" VALUES('old-0001',1,'state','{"state": "QUEUED", "message": "submitted", "restarts": 0, "time": 1796154644.428093}');
INSERT INTO "events" VALUES('old-0001',2,'state','{"state": "STARTING", "message": "starting 1 worker", "restarts": 0, "time": 1796154644.4382093}');
INSERT INTO "events" VALUES('old-0001',3,'state','{"state": "RUNNING", "message": "running", "restarts": 0, "time": 1796154644.4413004}');
INSERT INTO "events" VALUES('old-0001',4,'metrics','{"step": 1, "loss": 9.0, "time": 1001.0}');
INSERT INTO "events" VALUES('old-0001',5,'metrics','{"step": 2, "loss": 8.0, "time": 1002.0}');
INSERT INTO "events" VALUES('old-0001',6,'metrics','{"step": 3, "loss": 7.0, "time": 1003.0}');
INSERT INTO "events" VALUES('old-0001',7,'metrics','{"step": 4, "loss": 6.0, "time": 1004.0}');
INSERT INTO "events" VALUES('old-0001',8,'metrics','{"step": 5, "loss": 5.0, "time": 1005.0}');
INSERT INTO "events" VALUES('old-0001',9,'log','{"rank": 0, "step": 1, "time": 1001.0, "line": "step 1"}');
INSERT INTO "events" VALUES('old-0001',10,'log','{"rank": 0, "step": 2, "time": 1002.0, "line": "step 2"}');
INSERT INTO "events" VALUES('old-0001',11,'log','{"rank": 0, "step": 3, "time": 1003.0, "line": "step 3"}');
INSERT INTO "events" VALUES('old-0001',12,'checkpoint','{"step": 5, "path": "/data/old-0001/ckpt/step-5", "time": 1999.0}');
INSERT INTO "events" VALUES('old-0001',13,'state','{"state": "SUCCEEDED", "message": "done", "restarts": 0, "time": 1796154644.4498053}');
INSERT INTO "events" VALUES('old-0002',1,'state','{"state": "QUEUED", "message": "submitted", "restarts": 0, "time": 1796154644.4511523}');
CREATE TABLE heartbeat (
	id INTEGER NOT NULL, 
	at FLOAT NOT NULL, 
	PRIMARY KEY (id)
);
CREATE TABLE jobs (
	id VARCHAR(80) NOT NULL, 
	name VARCHAR(80) NOT NULL, 
	owner VARCHAR(80) NOT NULL, 
	state VARCHAR(16) NOT NULL, 
	message TEXT NOT NULL, 
	spec_json TEXT NOT NULL, 
	created_at FLOAT NOT NULL, 
	updated_at FLOAT NOT NULL, 
	step INTEGER NOT NULL, 
	total_steps INTEGER NOT NULL, 
	restarts INTEGER NOT NULL, 
	restart_reasons_json TEXT NOT NULL, 
	history_json TEXT NOT NULL, 
	checkpoints_json TEXT NOT NULL, 
	idempotency_key VARCHAR(200), 
	request_hash VARCHAR(64), 
	submitted_json TEXT, 
	started INTEGER NOT NULL, 
	log_time FLOAT NOT NULL, 
	log_seq INTEGER, 
	placement_json TEXT, 
	PRIMARY KEY (id), 
	UNIQUE (owner, idempotency_key)
);
INSERT INTO "jobs" VALUES('old-0001','old','alice','SUCCEEDED','done','{"name": "old", "model": {"name": "llama", "flavor": "tiny"}, "training": {"steps": 5}}',1.79615464442809295657e+09,1.79615464444980525975e+09,5,5,0,'[]','[{"state": "QUEUED", "time": 1796154644.428093, "message": "submitted"}, {"state": "STARTING", "time": 1796154644.4370425, "message": "starting 1 worker"}, {"state": "RUNNING", "time": 1796154644.440915, "message": "running"}, {"state": "SUCCEEDED", "time": 2000.0, "message": "done"}]','[{"step": 5, "path": "/data/old-0001/ckpt/step-5", "time": 1999.0}]','key-1','hhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhh','{"name": "old", "model": {"name": "llama", "flavor": "tiny"}, "training": {"steps": 5}}',1,1003.0,3,'[{"rank": 0, "node": "abc", "ip": "127.0.0.1"}]');
INSERT INTO "jobs" VALUES('old-0002','waiting','bob','QUEUED','submitted','{"name": "old", "model": {"name": "llama", "flavor": "tiny"}, "training": {"steps": 5}}',1.79615464445115232466e+09,1.79615464445115232466e+09,0,5,0,'[]','[{"state": "QUEUED", "time": 1796154644.4511523, "message": "submitted"}]','[]',NULL,NULL,NULL,0,0.0,NULL,NULL);
CREATE TABLE leases (
	name VARCHAR(40) NOT NULL, 
	holder VARCHAR(120) NOT NULL, 
	expires_at FLOAT NOT NULL, 
	PRIMARY KEY (name)
);
INSERT INTO "leases" VALUES('supervisor','old-replica',1.79615465445218110088e+09);
CREATE TABLE metrics (
	job_id VARCHAR(80) NOT NULL, 
	step INTEGER NOT NULL, 
	record_json TEXT NOT NULL, 
	PRIMARY KEY (job_id, step)
);
INSERT INTO "metrics" VALUES('old-0001',1,'{"step": 1, "loss": 9.0, "time": 1001.0}');
INSERT INTO "metrics" VALUES('old-0001',2,'{"step": 2, "loss": 8.0, "time": 1002.0}');
INSERT INTO "metrics" VALUES('old-0001',3,'{"step": 3, "loss": 7.0, "time": 1003.0}');
INSERT INTO "metrics" VALUES('old-0001',4,'{"step": 4, "loss": 6.0, "time": 1004.0}');
INSERT INTO "metrics" VALUES('old-0001',5,'{"step": 5, "loss": 5.0, "time": 1005.0}');
CREATE INDEX ix_jobs_owner ON jobs (owner);
CREATE INDEX ix_jobs_created_at ON jobs (created_at);
CREATE INDEX ix_jobs_name ON jobs (name);
CREATE INDEX ix_jobs_state ON jobs (state);
COMMIT;
