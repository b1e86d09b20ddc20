-- Forge's own tables on MySQL 8.0+ / MariaDB 10.6+, as Forge's Flyway scripts make them (columns
-- pinrotate does not read are left out): the data-connection passwords, the low-code CRUD configs
-- that say which business columns are encrypted, and one low-code business table. Schema only.
-- See examples/forge-mysql.toml; `mysql forge < examples/forge-mysql.sql` loads it.
--
-- Encrypted values are what Forge writes: `FPC1:<SM4|AES>:<keyId>:<base64>` (SM4 or AES, ECB,
-- PKCS#7) and, from before write-versioned was on, the bare base64 under the legacy key.
-- pinrotate rewrites only the encrypted columns of live rows (del_flag = '0'), keeps
-- `update_time ... ON UPDATE CURRENT_TIMESTAMP` as it was, and never runs DDL.

CREATE TABLE IF NOT EXISTS `ai_report_data_connection` (
  `id` bigint NOT NULL AUTO_INCREMENT COMMENT '主键ID',
  `tenant_id` bigint NOT NULL DEFAULT 1 COMMENT '租户ID',
  `connection_code` varchar(64) NOT NULL COMMENT '连接编码',
  `connection_name` varchar(100) NOT NULL COMMENT '连接名称',
  `db_type` varchar(32) NOT NULL COMMENT '数据库类型：MYSQL/POSTGRESQL/ORACLE/SQLSERVER',
  `driver_class_name` varchar(200) NOT NULL COMMENT '驱动类名',
  `jdbc_url` varchar(1000) NOT NULL COMMENT 'JDBC连接地址',
  `username` varchar(128) NOT NULL COMMENT '用户名',
  `password_cipher` varchar(500) DEFAULT NULL COMMENT '密码密文',
  `schema_name` varchar(128) DEFAULT NULL COMMENT '模式名/数据库名',
  `status` tinyint NOT NULL DEFAULT 1 COMMENT '状态：1启用 0禁用',
  `create_by` varchar(64) DEFAULT NULL COMMENT '创建者',
  `create_time` datetime NOT NULL DEFAULT CURRENT_TIMESTAMP COMMENT '创建时间',
  `update_by` varchar(64) DEFAULT NULL COMMENT '更新者',
  `update_time` datetime NOT NULL DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP COMMENT '更新时间',
  `del_flag` char(1) NOT NULL DEFAULT '0' COMMENT '删除标志（0正常 1删除）',
  -- V1.0.11: unique only among live rows
  `logic_delete_active` tinyint GENERATED ALWAYS AS (CASE WHEN del_flag = '0' THEN 1 ELSE NULL END) STORED
      COMMENT '未删除唯一约束标识',
  PRIMARY KEY (`id`),
  UNIQUE KEY `uk_data_connection_code_tenant_active` (`tenant_id`, `connection_code`, `logic_delete_active`),
  KEY `idx_data_connection_status` (`tenant_id`, `status`)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='平台数据连接';

CREATE TABLE IF NOT EXISTS `ai_crud_config` (
  `id` bigint NOT NULL COMMENT '主键',
  `tenant_id` bigint DEFAULT 1 COMMENT '租户ID',
  `config_key` varchar(64) NOT NULL COMMENT '配置唯一标识（小写字母+数字+下划线）',
  `table_name` varchar(128) NOT NULL COMMENT '关联的数据库表名',
  `table_comment` varchar(255) DEFAULT '' COMMENT '表描述/功能名称',
  `mode` varchar(16) NOT NULL DEFAULT 'CONFIG' COMMENT '模式：CONFIG-配置驱动 / CODEGEN-代码生成',
  `status` char(1) NOT NULL DEFAULT '0' COMMENT '状态（0启用 1停用）',
  -- the encrypted fields of table_name: {"phone": {"algorithm": "SM4"}, "idCard": {"algorithm": "AES"}}
  -- (camelCase fields, snake_case columns, each field's algorithm)
  `encrypt_config` json DEFAULT NULL COMMENT '接口加解密配置',
  `create_time` datetime DEFAULT NULL COMMENT '创建时间',
  `update_time` datetime DEFAULT NULL COMMENT '更新时间',
  PRIMARY KEY (`id`),
  UNIQUE KEY `uk_config_key` (`config_key`),
  KEY `idx_table_name` (`table_name`),
  KEY `idx_tenant_id` (`tenant_id`)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='CRUD配置驱动表';

-- A low-code business table (config_key 'crm_customer') with Forge's base columns and two
-- encrypted fields.
CREATE TABLE IF NOT EXISTS `crm_customer` (
  `id` bigint NOT NULL AUTO_INCREMENT COMMENT '主键',
  `tenant_id` bigint NOT NULL DEFAULT 1 COMMENT '租户ID',
  `customer_name` varchar(128) NOT NULL COMMENT '客户名称',
  `phone` varchar(255) DEFAULT NULL COMMENT '手机号（加密）',
  `id_card` varchar(255) DEFAULT NULL COMMENT '身份证号（加密）',
  `create_by` bigint DEFAULT NULL COMMENT '创建者',
  `create_time` datetime NOT NULL DEFAULT CURRENT_TIMESTAMP COMMENT '创建时间',
  `create_dept` bigint DEFAULT NULL COMMENT '创建部门',
  `update_by` bigint DEFAULT NULL COMMENT '更新者',
  `update_time` datetime NOT NULL DEFAULT CURRENT_TIMESTAMP ON UPDATE CURRENT_TIMESTAMP COMMENT '更新时间',
  `del_flag` char(1) NOT NULL DEFAULT '0' COMMENT '删除标志（0正常 1删除）',
  PRIMARY KEY (`id`),
  KEY `idx_crm_customer_tenant` (`tenant_id`)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COMMENT='客户';
